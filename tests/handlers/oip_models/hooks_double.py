"""Hooks around the null driver: every input doubled, its dtype kept."""


def preprocess(inputs):
    return {name: value * 2 for name, value in inputs.items()}
