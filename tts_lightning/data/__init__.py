"""Manifests, audio loading, clip validation, batching and the shipped demo dataset."""
