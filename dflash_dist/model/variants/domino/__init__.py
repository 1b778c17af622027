"""Domino (``drafter.variant=domino``): ``variant.py`` (the class on the seam), ``head.py`` (the GRU correction
head, its loss, decode, curriculum, FLOPs and export layout), ``serving.py`` (its part of the exported
``modeling_dflash.py``)."""
