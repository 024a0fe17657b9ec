"""One per cluster: plans slots per queue (pure planning and placement), serves the API and UI."""
