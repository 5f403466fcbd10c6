"""Offline evaluation (`eval`) and synthetic SFT data generation (`synthesize`) over verifiers environments."""
