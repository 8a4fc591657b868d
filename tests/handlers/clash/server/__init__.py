"""A model that ships a top-level package named like mserve's own."""
