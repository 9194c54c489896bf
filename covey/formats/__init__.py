"""covey's formats for people (settings.FORMAT_MODULE_PATH): times to the second, one way."""
