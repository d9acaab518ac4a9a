"""Stand-in for neuron-monitor's Prometheus exporter on Trainium nodes (none here).

On a Trainium node, ``neuron-monitor`` (aws-neuron-tools) reports the Neuron runtimes' and
devices' counters as JSON, and its companion ``neuron-monitor-prometheus.py`` serves them as
Prometheus series (the aws-neuron-sdk neuron-monitor user guide; the script ships in
/opt/aws/neuron/bin). This stand-in serves the series the chart's dashboard reads, with the
script's own metric names, types and labels, for the EC2 instances it is given, so the
dashboard's Neuron row is queried against a real Prometheus. The values are synthetic: nothing
here measures a device.

What the script exports and this serves (its ``process_*`` functions):

| series | type | labels besides the instance's |
|---|---|---|
| ``neuroncore_utilization_ratio`` | gauge | ``runtime_tag``, ``neuroncore`` |
| ``neuron_runtime_memory_used_bytes`` | gauge | ``runtime_tag``, ``memory_location`` (``host``, ``neuron_device``) |
| ``execution_errors_total`` | counter | ``runtime_tag``, ``error_type`` |
| ``hardware_ecc_events_total`` | counter | ``event_type``, ``neuron_device_index`` |

The instance labels are ``instance_name``, ``instance_id``, ``instance_type``,
``availability_zone``, ``region``, ``subnet_id`` (``get_instance_labels``).
"""

from __future__ import annotations

import random
import time

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# the names the dashboard may read (tests/chart/test_render.py checks it reads no other)
SERIES = ("neuroncore_utilization_ratio", "neuron_runtime_memory_used_bytes", "execution_errors_total",
          "hardware_ecc_events_total")
INSTANCE_LABELS = ("instance_name", "instance_id", "instance_type", "availability_zone", "region", "subnet_id")
ERROR_TYPES = ("generic", "numerical", "transient", "model", "runtime", "hardware")
ECC_EVENTS = ("mem_ecc_corrected", "mem_ecc_uncorrected", "sram_ecc_corrected", "sram_ecc_uncorrected")


class NeuronMonitorStandIn:
    """Serves the series for ``instances`` (EC2 instance ids) on 127.0.0.1:``port``, each with
    ``cores`` NeuronCores on ``devices`` devices, values drawn at every scrape."""

    def __init__(self, port: int, instances: list[str], instance_type: str = "trn1.32xlarge", cores: int = 4,
                 devices: int = 2):
        self.instances, self.instance_type, self.cores, self.devices = instances, instance_type, cores, devices
        self.started = time.time()
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.server, _ = start_http_server(port, addr="127.0.0.1", registry=self.registry)

    def _instance(self, iid: str) -> list[str]:
        return ["", iid, self.instance_type, "us-west-2d", "us-west-2", "subnet-0standin"]

    def collect(self):
        util = GaugeMetricFamily("neuroncore_utilization_ratio", "NeuronCore utilization ratio",
                                 labels=[*INSTANCE_LABELS, "runtime_tag", "neuroncore"])
        mem = GaugeMetricFamily("neuron_runtime_memory_used_bytes", "Runtime memory used bytes",
                                labels=[*INSTANCE_LABELS, "runtime_tag", "memory_location"])
        errors = CounterMetricFamily("execution_errors", "Execution errors total",
                                     labels=[*INSTANCE_LABELS, "runtime_tag", "error_type"])
        ecc = CounterMetricFamily("hardware_ecc_events", "Hardware ecc events total",
                                  labels=[*INSTANCE_LABELS, "event_type", "neuron_device_index"])
        elapsed = time.time() - self.started
        for iid in self.instances:
            inst = self._instance(iid)
            for core in range(self.cores):
                util.add_metric([*inst, "1", str(core)], random.uniform(0.3, 0.9))
            mem.add_metric([*inst, "1", "host"], 9.0e6)
            mem.add_metric([*inst, "1", "neuron_device"], 6.0e9 + random.uniform(0, 1e8))
            for kind in ERROR_TYPES:
                errors.add_metric([*inst, "1", kind], 0.0)
            for device in range(self.devices):
                for event in ECC_EVENTS:
                    # corrected memory errors tick up now and then; nothing uncorrected
                    ecc.add_metric([*inst, event, str(device)], float(int(elapsed // 5)) if event == ECC_EVENTS[0] else 0.0)
        yield from (util, mem, errors, ecc)

    def close(self) -> None:
        self.server.shutdown()
