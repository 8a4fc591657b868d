"""TorchServe's workflows: a ``.war`` names models and Python functions and the DAG that joins
them; its nodes run as registered models on the usual workers (docs/workflows.md)."""
