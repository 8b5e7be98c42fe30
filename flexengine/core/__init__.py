"""The ground: config schemas, errors, storage, hardware. Imports nothing of ours."""
