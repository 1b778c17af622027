"""Where the package's own files are: the Hydra config tree and the embedded tiny target."""

import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
CONF_DIR = os.path.join(PACKAGE_DIR, "conf")
ASSETS_DIR = os.path.join(PACKAGE_DIR, "assets")
TINY_DIR = os.path.join(ASSETS_DIR, "tiny")
