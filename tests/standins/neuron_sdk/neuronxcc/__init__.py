"""STAND-IN for neuronx-cc (the Neuron compiler; not on the public index). NxD 2.29 imports a
few of its NKI names at module level (flash attention's config, the NKI language module, the
ring-attention collectives config). Each name exists so those imports succeed; using one
raises: the NxD tier runs none of NxD's NKI kernels. See tests/standins/README.md."""


def unavailable(what: str):
    """A class whose construction says that the stand-in cannot do ``what``."""
    class Unavailable:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"{what} needs the real neuronx-cc (this is the NxD tier's stand-in)")
    Unavailable.__name__ = what.split(".")[-1]
    return Unavailable
