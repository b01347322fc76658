"""kvwire.subscriber."""
