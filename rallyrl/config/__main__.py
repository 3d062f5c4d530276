"""``python -m rallyrl.config --markdown > docs/config.md``: print the generated reference page."""

import sys

from .docs import config_markdown

if "--markdown" in sys.argv:
    print(config_markdown())
