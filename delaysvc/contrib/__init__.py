"""Integrations with frameworks delaysvc lives inside (`delaysvc.contrib.django`)."""
