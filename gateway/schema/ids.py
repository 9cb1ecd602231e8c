"""What the gateway accepts as a trajectory or group id (URL paths, headers, bodies)."""

from __future__ import annotations

import re

#: 1-128 characters that are literal in a URL path, starting with a letter or digit
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}")
