"""The core run: a rank's parts (data, model, precision, optimizer, state), built in order and trained
by one loop. Nothing here knows which launcher started the process."""
