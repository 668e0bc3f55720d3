DROP TABLE IF EXISTS {{ident .Schema .Dead}};
