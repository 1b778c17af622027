"""DFlash2 (``drafter.variant=dflash2``): ``variant.py`` (the class on the seam), ``layers.py`` (the convolution
layers, settings, FLOPs and export contract), ``selector.py`` (the candidate selector), ``export_checks.py`` (what
both engines need of an export), ``serving.py`` (its part of the exported ``modeling_dflash.py``)."""
