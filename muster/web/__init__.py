"""The dashboard's templates and static files (package data), served by the controller.

Nothing here runs on its own: muster.controller.dashboard renders the templates (Jinja2) and
serves the static files behind the API's credentials. The pages work without a build step;
the one script (static/muster.js) refreshes fragments and runs the virtualised log view.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"
