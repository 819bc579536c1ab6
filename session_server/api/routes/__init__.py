"""The HTTP routes, one APIRouter per resource; `session_server.app` includes them.

Handlers read what they share from `request.app.state` (`common.py`), so a router
holds no state of its own and one module serves every app a process builds.
"""
