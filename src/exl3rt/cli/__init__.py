"""The ``exl3rt`` command line."""
