"""Plots, dashboards and metric sinks. Nothing in the core imports this package."""
