"""DFlash (z-lab), the default variant and the base class of every other: ``variant.py`` (the class) and
``serving.py`` (the base of the exported ``modeling_dflash.py``)."""
