"""A package in the model folder, imported as mypkg.service."""
