"""The demo data fixtures (`demo_data`, `make_datamodule`) live in tests/conftest.py."""
