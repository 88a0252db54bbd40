"""The routing plan (one stable argsort) and the local gather/combine dispatcher."""
