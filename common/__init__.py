"""The ground floor every part stands on: the model format both sides share, the project's error type and the
dataclass-driven options of its configurations. It imports nothing of the project above it."""
