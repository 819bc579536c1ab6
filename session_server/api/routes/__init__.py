"""The app's routes, one APIRouter per module; `app.py` includes them."""
