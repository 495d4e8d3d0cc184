"""The collector's HTTP layer: create_app and the agents' and jobs' routes (app), and one module per
feature with its routes and its wiring (access, artifacts, automation, insight, metrics, openapi,
pages with the legacy pages' HTML). The only part of the collector that imports aiohttp.web."""
