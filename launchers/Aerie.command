#!/bin/bash
# Aerie for macOS: double-click in Finder to start the chat in a Terminal window.
# The checkout is the folder above this file. Finder runs it only while it is executable
# (chmod +x launchers/Aerie.command); Terminal keeps the window open if Aerie stops with an error.
cd "$(dirname "$0")/.." || exit 1
exec python3 launch.py "$@"
