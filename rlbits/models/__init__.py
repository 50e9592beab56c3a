"""Loading and saving HF models; value and ILQL heads; tiny configs for tests."""
