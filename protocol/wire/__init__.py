"""The wire types: messages, their MessagePack codec, errors, key names and the adapter
files' layout. msgspec and numpy only; every side imports these."""
