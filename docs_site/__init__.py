"""The documentation site's build-time code (mkdocs.yml's hook): reference pages generated from
the code, so that they cannot drift from it."""
