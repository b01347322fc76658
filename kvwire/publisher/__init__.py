"""kvwire.publisher."""
