"""Wire protocol, authentication, host parsing and settings shared by driver and workers."""
