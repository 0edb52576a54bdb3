"""``python -m fastpar.debug analyse DIR``: the flight recorder's analysis of the dumps in DIR."""

from __future__ import annotations

from fastpar.flight.files import main

raise SystemExit(main())
