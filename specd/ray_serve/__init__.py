"""specd on Ray Serve: target, draft and coordinator deployments, session-affine routing.

`specd.ray_serve.app:build_app` is the application builder `serve run` and the config file in
deploy/ray/ name; see docs/design.md ("Ray Serve") for how sessions stay on their replicas.
Importing this package does not import Ray; its modules that need Ray do.
"""
