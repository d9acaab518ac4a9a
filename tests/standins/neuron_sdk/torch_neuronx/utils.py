"""STAND-IN: torch_neuronx.utils.get_platform_target, which the real package answers from the
instance's identity ("trn1", "trn2", ...). Here: TRN_STANDIN_PLATFORM, default "trn1" (the
chip generation NxD's XLA + NxD path serves)."""

import os


def get_platform_target() -> str:
    return os.environ.get("TRN_STANDIN_PLATFORM", "trn1")
