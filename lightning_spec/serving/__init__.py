"""Moved to `lightning_spec.online` (`serving.online` is now `online.loop`); each module here
warns and hands over its new one, and the package goes in the next release."""
