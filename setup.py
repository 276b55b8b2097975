"""Shim so that tools which still call ``setup.py`` work; all metadata is in setup.cfg."""

from setuptools import setup

setup()
