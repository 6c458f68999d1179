"""Shipped device profiles (TOML package data)."""
