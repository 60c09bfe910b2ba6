"""Dashboard templates and static files served by the controller."""
