"""The OpenAI-compatible HTTP server: routes, request/response models, metrics and the dashboard."""
