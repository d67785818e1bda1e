"""Configuration: the settings model, delay levels, and the checks of what users give."""
