"""The manager's HTTP API and server: the FastAPI app, its routers, the admin login, /metrics."""
