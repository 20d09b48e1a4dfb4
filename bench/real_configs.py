"""Moved to :mod:`miles.models.config_folders` (``python -m miles.models.config_folders OUT_DIR``);
this name stays for the benchmarks that import it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.models.config_folders import *  # noqa: E402,F403
from miles.models.config_folders import VAE_WAN22, main, model_spec, write_config_folder  # noqa: E402,F401

if __name__ == "__main__":
    main()
