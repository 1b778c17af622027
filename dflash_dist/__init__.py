"""dflash_dist: train DFlash speculative-decoding drafters with one process per GPU under torchrun."""

__version__ = "0.1.0"
