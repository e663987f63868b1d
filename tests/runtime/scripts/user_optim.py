"""An optimizer class in a user's module: the PS ranks import it by its qualified name (tests put this
directory on PYTHONPATH, as a cluster job would)."""
import torch


class PlainSGD(torch.optim.SGD):
    """SGD under another name: stepping it must give SGD's result on the PS too."""
