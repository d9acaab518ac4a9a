"""The local control plane: a real Kubernetes control plane with kwok-simulated Trainium nodes."""
