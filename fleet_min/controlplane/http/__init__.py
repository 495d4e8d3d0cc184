"""The control plane's HTTP layer: app.py builds the plane and the features, and each module
here puts one feature on the app (its routes with what they need, its loops as a cleanup
context, its hooks). The only package of the control plane that imports aiohttp.web; only
cli.py imports it."""
