DROP TABLE IF EXISTS {{ident .Schema .Table}};
