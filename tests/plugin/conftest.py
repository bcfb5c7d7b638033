"""The plugin's modules that need no vLLM (settings, lists, the reporter) are tested in the
product's environment too: its distribution's source directory goes on the path."""

from __future__ import annotations

import sys
from pathlib import Path

PLUGIN_SOURCE = Path(__file__).resolve().parents[2] / "plugin"
if str(PLUGIN_SOURCE) not in sys.path:
    sys.path.insert(0, str(PLUGIN_SOURCE))
