"""The release checks CI runs on every change (``.ci/run``): versions and compatibility, proven.

Each module is one check and runs alone (``python tools/release_checks <check>``):

- ``import_cycles``: no package imports itself in a circle.
- ``api_compat``: gen-interface's and the kit's public API against their last release tags; a
  break under a version that does not announce it fails.
- ``lowest``: each dependent package, installed in a fresh environment beside the lowest
  gen-interface and gen-backend-kit it declares (built from their release tags), imports and
  passes its smoke test.
- ``alone``: each package installed alone in a fresh environment imports; gen-interface alone
  serves a training loop's imports without loading any kit or backend module.
- ``static``: every package builds on its own, lints and type-checks.
"""
