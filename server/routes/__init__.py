"""The daemon's own endpoints: models.py (/v1/models, /health, /metrics), loads.py (/v1/loads),
sessions.py (named sessions' reset and delete). Each API kvfork speaks is a package of server/api/."""
