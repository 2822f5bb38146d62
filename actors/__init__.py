"""trio actors of the serving engine and the messages they exchange."""
