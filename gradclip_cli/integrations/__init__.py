"""Thin adapters that run :class:`gradclip_cli.monitor.GradMonitor` inside training frameworks.

Each module imports its framework when it is itself imported, and gradclip
imports none of them: ``import gradclip_cli`` works without Lightning or
transformers installed.
"""
